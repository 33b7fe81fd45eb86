from vit_hub.cli import main

raise SystemExit(main())
