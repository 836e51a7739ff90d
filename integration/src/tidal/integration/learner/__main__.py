import sys

from tidal.core.process import role_main
from tidal.integration.learner.service import main

sys.exit(role_main(main, "learner"))
