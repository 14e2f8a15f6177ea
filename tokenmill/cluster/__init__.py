"""Scale-out on Ray Serve: engine replicas behind one OpenAI endpoint (the server's own app,
mounted in a Serve ingress), a prefix-aware request router, and the `tokenmill batch` job on
Ray Data. Ray is imported only here, and only when a command asks for replicas."""
