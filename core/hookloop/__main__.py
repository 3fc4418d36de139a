from hookloop.tools.cli import main

raise SystemExit(main())
