from mamba2_rocm.cli import main

raise SystemExit(main())
