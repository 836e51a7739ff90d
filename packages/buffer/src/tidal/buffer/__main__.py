import sys

from tidal.buffer.service import main
from tidal.core.process import role_main

sys.exit(role_main(main, "buffer"))
