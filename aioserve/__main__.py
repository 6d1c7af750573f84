"""`python -m aioserve`: the same command line as the `aioserve` script."""

from aioserve.cli import main

raise SystemExit(main())
