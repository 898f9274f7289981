"""``python -m boundloop``: the command line."""

from boundloop.cli import main

main()
