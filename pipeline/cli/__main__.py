"""`python -m pipeline.cli ...` is `crl ...`."""

from pipeline.cli import main

main()
