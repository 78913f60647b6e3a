"""Starting and watching a whole real run on this machine: `diloco run`, `diloco syncer`, `diloco learner`, chaos runs, regional outages."""
