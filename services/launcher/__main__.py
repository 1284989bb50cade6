from services.launcher.stack import main

main()
