from gpulet.cli import main

main()
