from .cli import convert_main

if __name__ == "__main__":
    convert_main()
