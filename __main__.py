from kvguard.cli import main

raise SystemExit(main())
