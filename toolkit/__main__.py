"""`python -m toolkit` is the same as the `dmt` command."""

from toolkit.cli.main import main

raise SystemExit(main())
