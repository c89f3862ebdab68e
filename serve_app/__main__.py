from serve_app.cli import main

raise SystemExit(main())
