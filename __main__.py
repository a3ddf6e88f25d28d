from servelab.cli.main import main

main()
