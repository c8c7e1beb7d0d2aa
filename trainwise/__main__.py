from trainwise.cli import main

raise SystemExit(main())
