from lowvram.cli import main

main()
