import sys

from tidal.integration.learner.service import main

sys.exit(main())
