from slotfile.cli.app import main

main()
