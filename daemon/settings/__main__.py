"""`python -m edgellmd.settings --markdown [--readme FILE]`."""

import sys

from edgellmd.settings.reference import main

sys.exit(main())
