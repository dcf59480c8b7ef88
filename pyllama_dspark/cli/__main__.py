from pyllama_dspark.cli.main import main

main()
