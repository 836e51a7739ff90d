import sys

from tidal.buffer.service import main

sys.exit(main())
