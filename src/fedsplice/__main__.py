from fedsplice.app.cli import main

raise SystemExit(main())
