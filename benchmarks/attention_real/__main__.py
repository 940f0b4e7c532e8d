"""``python -m benchmarks.attention_real``: run the suite (its options: ``--help``)."""

from benchmarks.attention_real import main

raise SystemExit(main())
