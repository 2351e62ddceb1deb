import sys

try:
    from plait.cli import main
except KeyboardInterrupt:  # Ctrl-C while Python imports the command line (under `plait train --nproc`, forwarded
    sys.exit(128 + 2)  # to each rank as it starts): 130, as at any later moment, not a KeyboardInterrupt traceback

sys.exit(main())
