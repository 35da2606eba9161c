"""`python -m serving`: the OpenAI-compatible server with the flags of `jaxdecode serve`, for
callers below the apps layer (the load test's started server) that must not run the CLI."""

from __future__ import annotations

import argparse
import sys

from serving.server import add_arguments, main


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m serving", description=__doc__.split("\n")[0])
    add_arguments(p)
    return p.parse_args(argv)


if __name__ == "__main__":
    sys.exit(main(parse_args()))
