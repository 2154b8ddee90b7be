from specbench.cli.main import main

raise SystemExit(main())
