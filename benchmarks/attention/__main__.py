"""``python -m benchmarks.attention``: run the suite (its options: ``--help``)."""

from benchmarks.attention import main

raise SystemExit(main())
