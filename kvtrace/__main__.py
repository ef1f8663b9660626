from kvtrace.cli import main

main()
