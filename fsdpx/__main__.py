import sys

if sys.argv[1:2] == ["jobs"]:  # the multi-job planner's own command line
    from fsdpx.jobs.cli import main as jobs_main

    jobs_main(sys.argv[2:])
else:
    from fsdpx.train.cli import main

    main()
