"""`python -m tuitrain`: the same command as the `tuitrain` console script."""

from tuitrain.cli import main

raise SystemExit(main())
