"""``python -m benchmarks.prompt``: run the suite (its options: ``--help``)."""

from benchmarks.prompt import main

raise SystemExit(main())
