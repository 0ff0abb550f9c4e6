from pipetrain.backend.cli import main

raise SystemExit(main())
