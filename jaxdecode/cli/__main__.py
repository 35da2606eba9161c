"""`python -m jaxdecode.cli ...` is the `jaxdecode` command."""

import sys

from jaxdecode.cli import main

sys.exit(main())
