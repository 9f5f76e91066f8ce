"""python -m tiered.checkpoint inspect|verify PATH [--json]"""

import sys

from .cli import main

sys.exit(main())
