"""``python -m kvcodec``: the ``kvcodec`` command, for environments whose scripts folder is not on the PATH."""

import sys

from kvcodec.cli import main

sys.exit(main())
