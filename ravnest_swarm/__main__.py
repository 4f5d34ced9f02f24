from ravnest_swarm.cli import main

main()
