from fsdpx.train.cli import main

main()
