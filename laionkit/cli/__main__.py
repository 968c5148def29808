"""`python -m laionkit.cli` and `accelerate launch -m laionkit.cli`: the `laionkit` command."""

from laionkit.cli import main

main()
