# Lightning's vendored sources are run by the harness, never collected as tests here.
collect_ignore_glob = ["vendor/*"]
