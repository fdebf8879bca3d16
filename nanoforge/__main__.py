"""`python -m nanoforge ...` (and `torchrun ... -m nanoforge train ...`): the `nanoforge` command."""

import sys

from nanoforge.cli import main

sys.exit(main())
