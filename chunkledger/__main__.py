"""``python -m chunkledger``: the same command line as the ``chunkledger`` console script."""

from chunkledger.main import main

main()
