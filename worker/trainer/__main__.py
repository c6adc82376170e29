"""`python -m worker.trainer --spec job.yaml` (under torchrun for more than one rank)."""

import sys

from worker.trainer.main import main

sys.exit(main())
