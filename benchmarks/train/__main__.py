"""``python -m benchmarks.train``: run the suite (its options: ``--help``)."""

from benchmarks.train import main

raise SystemExit(main())
