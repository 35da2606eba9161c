"""`python -m jaxdecode.cli.bench.loadtest` (the flags of `jaxdecode bench --serve`)."""

import sys

from jaxdecode.cli.bench.loadtest.command import build_parser, main

sys.exit(main(build_parser().parse_args()))
