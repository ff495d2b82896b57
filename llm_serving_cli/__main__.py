from llm_serving_cli.main import main

main()
