#!/usr/bin/perl

# The systemd units in examples/systemd: systemd-analyze accepts them (with
# the rig's llama-server where the unit names its binary), and the
# tmpfiles.d entry makes the store folder as docs/directives.md asks:
# setgid, mode 2775, group www-data (nginx's workers).

use strict;
use warnings;

use FindBin;
use lib "$FindBin::Bin/lib";

use LlamaTest;
use Test::More;

my $t = LlamaTest->new(workers => 1);
my $dir = $t->dir;
my $ex = "$LlamaTest::ROOT/examples/systemd";

-x '/usr/bin/systemd-analyze' or plan skip_all => 'no systemd-analyze';

my $unit = $t->read_file("$ex/llama-server.service");
my $bin = LlamaTest::llama_binary();
like($unit, qr{--slot-save-path /var/lib/llama-session}, 'the unit saves to the store folder');
like($unit, qr{--no-kv-unified}, 'with the flags the module needs');
$unit =~ s{/usr/local/bin/llama-server}{$bin};
$unit =~ s{^User=llama$}{User=nobody}m;
$unit =~ s{^Group=llama$}{Group=nogroup}m;
open my $fh, '>', "$dir/llama-server.service" or die;
print $fh $unit;
close $fh;
my $out = `/usr/bin/systemd-analyze verify --man=no $dir/llama-server.service 2>&1`;
is($?, 0, 'systemd-analyze verify: llama-server.service') or diag $out;

mkdir "$dir/nginx.service.d";
open $fh, '>', "$dir/nginx.service" or die;
print $fh "[Service]\nExecStart=/bin/true\n";
close $fh;
system('cp', "$ex/nginx.service.d/llama-session.conf", "$dir/nginx.service.d/");
$out = `cd $dir && /usr/bin/systemd-analyze verify --man=no $dir/nginx.service 2>&1`;
unlike($out, qr/llama-session\.conf.*(error|unknown|invalid)/i,
       'the drop-in for nginx.service parses') or diag $out;

# the folder, made by systemd-tmpfiles under a root of the test's own
my $conf = $t->read_file("$ex/llama-session.tmpfiles.conf");
like($conf, qr{^d /var/lib/llama-session 2775 llama www-data -$}m,
     'tmpfiles.d: the store folder, 2775, llama:www-data');
# the root's own users: the machine's, and llama as the unit's comment
# makes it
mkdir "$dir/root";
mkdir "$dir/root/etc";
system("cp /etc/passwd /etc/group $dir/root/etc/") == 0 or die;
open my $pwf, '>>', "$dir/root/etc/passwd" or die;
print $pwf "llama:x:64990:64990::/var/lib/llama:/usr/sbin/nologin\n";
close $pwf;
open $fh, '>', "$dir/tmpfiles.conf" or die;
print $fh $conf;
close $fh;
$out = `/usr/bin/systemd-tmpfiles --root=$dir/root --create $dir/tmpfiles.conf 2>&1`;
is($?, 0, 'systemd-tmpfiles creates it') or diag $out;
my @st = stat "$dir/root/var/lib/llama-session";
ok(@st, 'the folder exists');
is(sprintf('%04o', $st[2] & 07777), '2775', 'mode 2775 (setgid)');
is(scalar getgrgid($st[5]), 'www-data', 'group www-data');
is($st[4], 64990, 'owner llama');

$t->stop;
done_testing;
