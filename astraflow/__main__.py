from astraflow.cli import main

main()
