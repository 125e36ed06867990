"""`python -m molt.config --config RECIPE [--set a.b=v ...]`: print the resolved config as JSON."""

import sys

from molt.config import main

sys.exit(main())
