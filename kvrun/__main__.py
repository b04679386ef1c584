"""`python -m kvrun ...` runs the kvrun command line."""

from kvrun.cli.main import main

main()
