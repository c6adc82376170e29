"""`python -m cli ...`: the same as the `meshkeeper` console script."""

import sys

from cli.main import main

sys.exit(main())
