from services.launcher.main import main

main()
