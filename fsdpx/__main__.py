from fsdpx.cli import main

main()
