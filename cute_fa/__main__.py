"""``python -m cute_fa <command>``: the command-line tools (``cute_fa/tools``).

The entry point belongs to the tools: nothing in the library imports this module.
"""

import sys

from cute_fa.tools.cli import main

sys.exit(main())
