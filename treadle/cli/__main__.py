"""`python -m treadle.cli`: the `treadle` command."""

import sys

from treadle.cli.main import main

if __name__ == "__main__":
    sys.exit(main())
