from hstrace.cli.main import main

main()
